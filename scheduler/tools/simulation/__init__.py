"""Model-free what-if simulation, one concern a module; `scheduler.tools.simulate` is its public face (and its
docstring the overview). Nothing is imported here, so a module of the package loads only what it needs."""
