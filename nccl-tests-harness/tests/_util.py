"""Shared test helpers: import path and fixtures."""

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.dirname(TESTS)
REPO = os.path.dirname(HARNESS)
FIXTURES = os.path.join(TESTS, "fixtures")
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()
