"""The async scheduler (requests, slots, the step); see issue 3."""
