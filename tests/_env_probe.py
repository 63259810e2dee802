"""Helper of tests/test_dev_jobs.py, run as a dev.sh `module:` job: prints the value of the environment variable named
by its first argument (what an earlier `env:` job exported), or <unset>."""

import os
import sys

if __name__ == "__main__":
    print(f"{sys.argv[1]}={os.environ.get(sys.argv[1], '<unset>')}")
