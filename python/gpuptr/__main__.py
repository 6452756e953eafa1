"""``python -m gpuptr``: the command line (see ``gpuptr.cli``)."""

from gpuptr.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
