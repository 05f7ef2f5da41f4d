"""Built-in experts backends. Each registers through the `selector.backends` entry-point group, exactly as
a third-party package would: the core never imports this package by name."""
