"""The `scale-ocr` command line: subcommands, argument parsing, verify and memory estimates."""
