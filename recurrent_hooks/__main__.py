"""`python -m recurrent_hooks demo`: run the demo on a tiny model built from a config (no download)."""

import argparse

import transformers


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recurrent_hooks", description=__doc__)
    parser.add_argument("command", choices=["demo"], help="demo: read, patch and steer a tiny model's states")
    parser.parse_args()
    transformers.logging.set_verbosity_error()  # the "falling back to its reference PyTorch implementation" notices
    from .demo import main as demo

    demo()


if __name__ == "__main__":
    main()
