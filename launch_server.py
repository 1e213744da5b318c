"""Entry point: `python -m launch_server --model-path M [...]` (see `--help`)."""

from launch.launcher import main

if __name__ == "__main__":
    main()
