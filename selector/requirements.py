"""Judges one backend's requirements against the probe facts and the problem: a pure function, no I/O.

Machine facts are checked before the configuration: the device first (a CUDA-only backend asked for on a CPU
says it needs a CUDA GPU, not that the CPU model's float32 is the wrong dtype), then packages and the toolkit,
so an explicit request on the wrong machine says what is missing (ImportError) before it talks about dtypes
(ValueError).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from selector.gates import ACT_MUL, GATE_NAMES
from selector.probes import Environment
from selector.types import AVAILABLE, COMPILE_MODES, Availability, BackendSpec, Problem, Requirements, Status


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); '0.1.2.post1' -> (0, 1, 2). Enough for minimum-version checks."""
    parts = []
    for piece in version.split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _check_device(req: Requirements, problem: Problem, env: Environment) -> Availability | None:
    if problem.device not in req.devices:
        needs = "needs a CUDA GPU: " if req.devices == {"cuda"} else ""
        return Availability(
            Status.UNSUPPORTED_DEVICE,
            f"{needs}runs on {', '.join(sorted(req.devices))}, not on {problem.device}",
            f"move the model to {' or '.join(sorted(req.devices))}, or pick a backend that runs on {problem.device}",
        )
    if problem.device != "cuda":
        return None
    cc = env.compute_capability(problem.device_index)
    if cc is None:
        why = env.gpu.problem or "no CUDA GPU visible"
        return Availability(
            Status.UNSUPPORTED_HARDWARE,
            f"needs a CUDA GPU; none found ({why})",
            "run on a machine with an NVIDIA GPU and driver",
            found=f"GPU facts from {env.gpu.source}",
        )
    name = env.gpu.devices[problem.device_index].name
    low, high = req.min_compute_capability, req.max_compute_capability
    if (low and cc < low) or (high and cc >= high):
        wanted = f">= {_cc(low)}" if low else ""
        wanted += (" and " if low and high else "") + (f"< {_cc(high)}" if high else "")
        return Availability(
            Status.UNSUPPORTED_HARDWARE,
            f"needs compute capability {wanted}; {name} has {_cc(cc)}",
            "pick another backend for this GPU (selector doctor lists the ones that run here)",
            found=f"{name}, compute capability {_cc(cc)} (from {env.gpu.source})",
        )
    return None


def _check_packages(req: Requirements, env: Environment) -> Availability | None:
    for dist, minimum in req.packages.items():
        facts = env.package(dist)
        installed = facts.version if facts else None
        if installed is None:
            return Availability(
                Status.MISSING_PACKAGE,
                f"needs the Python package {dist!r}, which is not installed",
                f"pip install '{dist}{'>=' + minimum if minimum else ''}'",
                found=f"{dist}: not found ({facts.source if facts else 'not probed'})",
            )
        if minimum and version_tuple(installed) < version_tuple(minimum):
            return Availability(
                Status.PACKAGE_TOO_OLD,
                f"needs {dist} >= {minimum}; {installed} is installed",
                f"pip install -U '{dist}>={minimum}'",
                found=f"{dist} {installed} ({facts.source})",
            )
    return None


def _check_toolkit(req: Requirements, problem: Problem, env: Environment) -> Availability | None:
    if not req.toolkit or problem.device != "cuda":
        return None
    cc = env.compute_capability(problem.device_index)
    rules = [r for r in req.toolkit if cc and cc >= r.min_cc and (r.max_cc is None or cc < r.max_cc)]
    if not rules:
        return None
    rule = rules[0]
    tk = env.toolkit
    searched = "; ".join(tk.searched) or "nothing searched"
    need = f"nvcc >= {_cc(rule.nvcc)}" + (f" on {rule.family}" if rule.family else "")
    remedy = (
        f"install a full CUDA toolkit {_cc(rule.nvcc)} or newer (with nvcc) and point CUDA_HOME at it"
    )
    if tk.nvcc_version is None and not tk.runtime_only and tk.root is None:
        return Availability(
            Status.TOOLKIT_MISSING,
            f"compiles kernels at run time and needs a CUDA toolkit with {need}; none was found",
            remedy,
            found=f"searched CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda: {searched}",
        )
    if tk.nvcc_version is None:
        what = "a runtime-only install (no bin/nvcc)" if tk.runtime_only else (tk.problem or "nvcc unusable")
        return Availability(
            Status.TOOLKIT_MISSING,
            f"compiles kernels at run time and needs {need}; the toolkit at {tk.root} is {what}",
            remedy,
            found=f"{tk.root} (found by {tk.found_by})",
        )
    if tk.nvcc_version < rule.nvcc:
        return Availability(
            Status.TOOLKIT_TOO_OLD,
            f"needs {need}; nvcc {_cc(tk.nvcc_version)} was found",
            remedy,
            found=f"nvcc {_cc(tk.nvcc_version)} at {tk.nvcc_path} (found by {tk.found_by})",
        )
    return None


def gates_run(req: Requirements) -> frozenset[str]:
    """The gates of selector.gates a backend runs: those it declares, else act_mul, or every gate when its torch
    code calls the module's own _apply_gate (gating.custom)."""
    if req.gating.gates is not None:
        return req.gating.gates
    return frozenset(GATE_NAMES) if req.gating.custom else frozenset({ACT_MUL})


_ANOTHER = "pick another backend: `selector doctor` with this layer's flags (e.g. --weight-format) lists those that run it"


def _unsupported(what: str, remedy: str = _ANOTHER) -> Availability:
    return Availability(Status.UNSUPPORTED_CONFIG, what, remedy)


def _check_config(req: Requirements, p: Problem) -> Availability | None:
    def listed(values: frozenset[str]) -> str:
        return ", ".join(sorted(values))

    if p.dtype not in req.dtypes:
        return _unsupported(f"does not run {p.dtype} experts (supports {listed(req.dtypes)})")
    if p.weight_format not in req.weight_formats:
        return _unsupported(
            f"does not run {p.weight_format} expert weights (supports {listed(req.weight_formats)})"
        )
    if p.weight_format != "dense" and p.scale_format and p.scale_format not in req.scale_formats:
        return _unsupported(f"does not read {p.scale_format} scales (reads {listed(req.scale_formats)})")
    if p.weight_format != "dense" and p.activation_quant not in req.activation_quant:
        return _unsupported(
            f"does not run {p.activation_quant} activation quantisation (runs {listed(req.activation_quant)})"
        )
    gate, gating = p.gate, req.gating
    if p.gated and not gate.custom and gate.name not in gates_run(req):
        return _unsupported(f"does not run gate {gate.label()} (runs {listed(gates_run(req))})")
    # a gate other than act_mul is the whole function between the projections: the activation names act_mul's act
    acts = gating.activations
    if acts is not None and gate.activation not in acts and (not p.gated or gate.is_default):
        return _unsupported(f"does not run activation {gate.activation!r} (runs {listed(acts)})")
    flags: list[tuple[bool, bool, str]] = [
        (p.gated, gating.gated, "gated experts"),
        (not p.gated, gating.non_gated, "non-gated experts"),
        (p.has_bias, req.bias, "expert biases"),
        (p.is_transposed, req.transposed, "the transposed weight layout"),
        (p.interleaved, req.interleaved, "interleaved gate/up weights"),
        (gate.custom, gating.custom, "a custom gate function" + (f" ({gate.source})" if gate.source else "")),
        (p.post_expert_norm, req.post_expert_norm, "a post-expert norm"),
        (p.expert_parallel, req.expert_parallel, "expert parallelism"),
    ]
    for present, supported, what in flags:
        if present and not supported:
            return _unsupported(f"does not support {what}")
    return None


def _check_compile(spec: BackendSpec, problem: Problem) -> Availability | None:
    """The backend's declared torch.compile modes and fullgraph against how the call is traced."""
    call, calls = problem.call, spec.calls
    if not call.compile:
        return None
    declared = calls.supported_compile_modes()
    if call.compile_mode is not None and call.compile_mode not in declared:
        modes = ", ".join(m for m in COMPILE_MODES if m in declared) or "none"
        return _unsupported(
            f"does not run under torch.compile mode {call.compile_mode!r} (declares: {modes})",
            "compile with a mode it declares, or pick a backend that declares this mode (`selector doctor --markdown`)",
        )
    if call.fullgraph and not calls.traces_fullgraph():
        return _unsupported(
            "cannot be traced with torch.compile(fullgraph=True): it breaks the graph",
            "compile without fullgraph=True, or pick a fullgraph-safe backend such as grouped_mm",
        )
    return None


def _check_grad(spec: BackendSpec, problem: Problem) -> Availability | None:
    """The backend's declared backward against what autograd records a gradient for."""
    call, differentiable = problem.call, spec.calls.differentiable
    if not call.requires_grad or differentiable is None:
        return None
    if differentiable and problem.weight_format not in spec.calls.grad_weight_formats:
        return _unsupported(
            f"has no backward for {problem.weight_format} expert weights",
            "run under torch.no_grad() (or torch.inference_mode()), or dequantise the experts to train them",
        )
    missing = [name for name in call.grad_inputs if name not in differentiable]
    if missing:
        what = "has no backward" if not differentiable else f"has no gradient for {', '.join(missing)}"
        return _unsupported(
            f"{what} (autograd records a gradient for {', '.join(call.grad_inputs)})",
            "pick a differentiable backend such as grouped_mm, or run under torch.no_grad()",
        )
    return None


def evaluate(spec: BackendSpec, problem: Problem, env: Environment) -> Availability:
    """Whether `spec` can run `problem` on the machine `env` describes, and if not, why and the fix."""
    req = spec.requirements
    steps: list[Callable[[], Availability | None]] = [
        lambda: _check_device(req, problem, env),
        lambda: _check_packages(req, env),
        lambda: _check_toolkit(req, problem, env),
        lambda: _check_config(req, problem),
    ]
    for step in steps:
        verdict = step()
        if verdict is not None:
            return verdict
    refused = _check_compile(spec, problem)  # the declared mode / fullgraph: says more than the flag below
    if refused is not None:
        return refused
    if problem.call.compile and not spec.calls.compile_auto:
        return _unsupported("cannot be traced by torch.compile", "pick a compile-friendly backend such as grouped_mm")
    if problem.call.cuda_graph and not spec.calls.cuda_graphs:
        return _unsupported(
            "cannot be captured in a CUDA graph (it reads values on the host)",
            "pick a backend without host synchronisation, e.g. grouped_mm or triton_fused",
        )
    if spec.check is not None:
        try:
            verdict = spec.check(problem, env)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a plugin's bug (sys.exit included) is reported, not raised into the model
            return Availability(Status.PLUGIN_ERROR, f"its check raised {type(exc).__name__}: {exc}")
        if verdict is not None and not verdict.ok:
            return verdict
    # last: autograd is what the caller changes most easily (torch.no_grad), after the layer and the machine
    refused = _check_grad(spec, problem)
    if refused is not None:
        return refused
    return verdict if verdict is not None else AVAILABLE  # an ok verdict may carry facts (e.g. "cached at ...")
