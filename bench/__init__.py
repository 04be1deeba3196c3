"""Load and sweep tools for a running service: `dflash-load` (one server or two, by concurrency level) and
`dflash-sweep` (fixed blocks against the adaptive controller). Tooling, not product: nothing in
`service` or `speculative` imports it."""
