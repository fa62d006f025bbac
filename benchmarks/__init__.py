"""scale-ocr benchmarks (a regular package, so it wins over fairscale's top-level `benchmarks`)."""
