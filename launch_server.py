"""Entry point: `python -m launch_server --model-path M [...]` (see `--help`); the same as
`python -m specserve.launch_server`."""

from specserve.launch.launcher import main

if __name__ == "__main__":
    main()
