"""The headless browser of the browser tests (trace viewer, Ray dashboard): Debian's chromium, which
`make test` installs (`make browser`) where apt-get is and we are root."""
from __future__ import annotations

import os
import platform
import shutil

import pytest

BROWSER = next((b for b in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if b), None)


def browser_or_skip() -> str:
    """Chromium's path; a failure where `make test` installs it (Debian, as root), else a skip saying why."""
    if BROWSER is None:
        if platform.system() == "Linux" and shutil.which("apt-get") and os.geteuid() == 0:
            pytest.fail("no chromium: `make test` installs Debian's chromium for the browser tests (make browser)")
        pytest.skip("no chromium on this machine (`make browser` installs it where apt-get is)")
    return BROWSER
