"""The control of the crop task's GRPO (issue 43): train_grpo.py as it is, but env_geo3k's crop returns a
blank (white) image of the size the real crop would show, with the same text. If the policy gains from
the real crop what it does not gain here, it learnt from what the crop shows, not from calling it.

    python bench/blank_crop.py <train_grpo.py flags>          # one process (the local engine)
"""
import dataclasses
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core modules, however this is run
import env_geo3k  # noqa: E402
import train_grpo  # noqa: E402
import console  # noqa: E402

REAL_CROP = env_geo3k.TOOLS["image_zoom_in_tool"]


def blank_crop(env, arguments):
    """env_geo3k.crop's checks, text and numbering, its image replaced by a white one of the same size."""
    text, images, info = REAL_CROP.run(env, arguments)
    return text, [Image.new("RGB", im.size, "white") for im in images], info  # the env keeps the blank


def main(argv=None):
    train_grpo.__doc__ = __doc__  # --help: this file's purpose (train_grpo's parser's description), then its flags
    env_geo3k.TOOLS["image_zoom_in_tool"] = dataclasses.replace(REAL_CROP, run=blank_crop)  # the env reads TOOLS as it starts
    try:
        return train_grpo.main(argv)
    finally:  # a caller in this process (a test, --help) keeps the real crop
        env_geo3k.TOOLS["image_zoom_in_tool"] = REAL_CROP


if __name__ == "__main__":
    console.entry(main, train_grpo.parse_args)
