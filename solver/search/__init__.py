"""Choosing the configuration: the search space after pins, integer cost tables, the CP-SAT model and its
exact enumeration reference, the pipeline search, and the diagnosis of requests nothing satisfies."""
