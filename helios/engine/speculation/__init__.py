"""Speculative decoding: draft planning and the history drafter (drafter.py), and the learned
drafters, a core's MTP programs (mtp.py) and a separate draft core (draft_core.py). Drafts never
change what is generated: the engine verifies them against the target model."""
