"""Expert-parallel dispatch backends (DESIGN.md §3). Installed as `moefp8.dispatch`."""
