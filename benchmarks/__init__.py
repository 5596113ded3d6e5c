"""Benchmarks: serving (`serve`), engine ceiling (`engine`, `core`), scenarios (`interference`,
`repeat`) and the side-by-side comparison with another server (`compare`). See
docs/benchmarks.md."""
