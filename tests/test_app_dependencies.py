"""Says in the test summary when the app tier or the hypothesis-driven files were left out (see conftest.py)."""
import pytest

from conftest import HYPOTHESIS_FILES, MISSING_APP_PACKAGES, MISSING_TEST_PACKAGES


def test_app_dependencies():
    if MISSING_APP_PACKAGES:
        pytest.skip(f"app tests not collected: {', '.join(MISSING_APP_PACKAGES)} not installed (the GPU tier runs without the UI stack)")


def test_test_dependencies():
    if MISSING_TEST_PACKAGES:
        pytest.skip(f"{', '.join(HYPOTHESIS_FILES)} not collected: {', '.join(MISSING_TEST_PACKAGES)} not installed")
