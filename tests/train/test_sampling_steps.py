"""A number of validation sampling steps the family's sampler cannot take is refused at start-up, naming the key."""

from __future__ import annotations

import pytest

from vt.shared.errors import UserError


@pytest.mark.parametrize(("family", "refused"), [("ltx-video", True), ("ltx-2", True), ("wan", False)])
def test_one_step_is_refused_where_the_sampler_ends_at_a_terminal_shift(tiny_model_factory, family, refused):
    """LTX-Video's and LTX-2's schedulers stretch their sigmas to end at shift_terminal: at one step that divides by
    zero and the video came out NaN (PyAV then failed to encode LTX-2's sound). Wan's sampler takes one step."""
    from vt.shared.config import Config, build
    from vt.shared.models import spec_for
    from vt.train.validation import check_sampling_steps

    config = build(Config, {"model": {"family": family, "path": str(tiny_model_factory(family))}})
    spec = spec_for(config)
    check_sampling_steps(spec, 2, "validation.steps")
    if refused:
        with pytest.raises(
            UserError, match=r"validation_stack.steps = 1: .*shift_terminal = 0.1.*set validation_stack"
        ):
            check_sampling_steps(spec, 1, "validation_stack.steps")
    else:
        check_sampling_steps(spec, 1, "validation.steps")
