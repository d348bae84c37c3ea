"""Cross-cutting helpers: the command-line runner, logging, profiling, fault injection, building C code."""
