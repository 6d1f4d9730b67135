"""pytest's own set-up for this suite: the helpers under tests/support assert too, so pytest rewrites their asserts
(a failing helper then says what it compared, as a test does)."""

import pytest

pytest.register_assert_rewrite("tests.support")
