"""``scale-ocr make-cache PATH``: synthetic words rendered into a new image cache for ``--data-cache``
(:mod:`scale_ocr.data.cache`), drawn as a training run draws them."""

from __future__ import annotations

import argparse
from pathlib import Path

from scale_ocr.cli.args import parse_input_size
from scale_ocr.config import WORD_STYLES, DataConfig, TrainConfig
from scale_ocr.errors import UserError, report_user_errors, say, shown


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    from scale_ocr.data.cache import build_cache
    from scale_ocr.data.fonts import select
    from scale_ocr.vocab import VOCABS

    data = DataConfig()  # training's defaults: a cache draws the words a run on synthetic words would
    p = argparse.ArgumentParser(prog="scale-ocr make-cache", description="Render synthetic words, "
                                "validation-transformed, into a new image cache for --data-cache (PATH must not "
                                "exist). The word flags mean what training's do.")
    p.add_argument("path", metavar="PATH", help="the cache file to create")
    p.add_argument("-n", type=int, default=1024, help="words (default 1,024)")
    p.add_argument("--input-size", type=parse_input_size, default=(32, 128), metavar="HxW",
                   help="the images' height x width, as the run's --input-size (default 32x128)")
    p.add_argument("--vocab", default="latin", choices=sorted(VOCABS), help="the words' characters (default latin)")
    p.add_argument("--fonts", nargs="+", default=list(data.fonts), metavar="FONT",
                   help=f"the fonts words are set in, as training's --fonts (default {' '.join(data.fonts)})")
    p.add_argument("--synthetic-words", choices=WORD_STYLES, default=data.synthetic_words,
                   help=f"how words are cut, as training's (default {data.synthetic_words})")
    p.add_argument("--min-chars", type=int, default=data.min_chars, help=f"default {data.min_chars}")
    p.add_argument("--max-chars", type=int, default=data.max_chars, help=f"default {data.max_chars}")
    p.add_argument("--seed", type=int, default=0, help="the words' and their renderings' draw (default 0)")
    args = p.parse_args(argv)
    if args.n < 1 or min(args.input_size) < 1:
        p.error(f"-n {args.n} / --input-size {args.input_size[0]}x{args.input_size[1]}: use 1 or more")
    DataConfig(min_chars=args.min_chars, max_chars=args.max_chars)  # refused in one line as training refuses them
    TrainConfig(seed=args.seed)
    path = Path(args.path)
    if path.exists() or path.is_symlink():
        raise UserError(f"{shown(path)} already exists; make-cache never writes over a file: name a new one")
    chars = VOCABS[args.vocab]
    fonts = select(args.fonts, chars)
    say(fonts.line())
    say(build_cache(path, args.n, args.input_size, chars, args.min_chars, args.max_chars, args.seed,
                    style=args.synthetic_words, fonts=fonts))
    return 0
