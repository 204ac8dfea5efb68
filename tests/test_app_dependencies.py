"""Says in the test summary when the app tier was left out (see conftest.py)."""
import pytest

from conftest import MISSING_APP_PACKAGES


def test_app_dependencies():
    if MISSING_APP_PACKAGES:
        pytest.skip(f"app tests not collected: {', '.join(MISSING_APP_PACKAGES)} not installed (the GPU tier runs without the UI stack)")
