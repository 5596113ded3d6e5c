"""Benchmarks: serving (`serve`), engine ceiling (`engine`, `core`), scenarios (`interference`,
`repeat`), the side-by-side comparison with another server (`compare`) and prefix-cache eviction
(`evict`). See README.md."""
