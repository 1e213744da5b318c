"""`python -m specserve.launch_server --model-path M [...]` (see `--help`)."""

from specserve.launch.launcher import main

if __name__ == "__main__":
    main()
