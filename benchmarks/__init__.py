"""Performance benchmarks (`rayfed bench`); numbers and how they were taken: benchmarks/README.md."""
