"""`python -m gpuboot.replay`. Runs only as that (never when some loader execs the file by path)."""
if __name__ == "__main__" and __package__ == "gpuboot.replay":
    from gpuboot.replay.cli import main

    raise SystemExit(main())
