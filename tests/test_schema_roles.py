"""The chat reader's role check: a role that is not a string (a list, an object) is a 400 naming the message's role,
on the common two-key message's short path as on the long one."""
from __future__ import annotations

import pytest

from strata.serve import schema
from strata.serve.errors import ApiError


@pytest.mark.parametrize("role", [[], {}, ["user"], {"a": 1}, 3, None])
@pytest.mark.parametrize("extra", [{}, {"name": "x"}])
def test_a_role_that_is_not_a_string_is_refused_naming_it(role, extra):
    with pytest.raises(ApiError) as exc:
        schema.parse_chat({"messages": [{"role": "system", "content": ""}, {"role": role, "content": "", **extra}]})
    assert exc.value.status == 400 and "messages[1].role" in str(exc.value), str(exc.value)
