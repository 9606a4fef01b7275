"""The engine and its executor: what one rank does at each training step, action by action."""
