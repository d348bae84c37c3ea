"""Cross-cutting helpers: logging, profiling, fault injection."""
