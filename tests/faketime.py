"""libfaketime for tests that run a process on a clock of its own (the
lease holders of tests/objectstore/test_lease_clock.py, the save interval of
tests/multiprocess/test_policies_mp.py). `.ci/run` installs it; without it
those tests skip."""

import glob

import pytest

LIBS = [p for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                    "/usr/lib", "/usr/local/lib", "/usr/lib64")
        for p in glob.glob(f"{d}/faketime/libfaketime.so.1")]
needs_faketime = pytest.mark.skipif(
    not LIBS, reason="libfaketime is not installed (apt-get install "
    "faketime)")
