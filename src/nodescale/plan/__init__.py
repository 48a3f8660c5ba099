"""``nodescale plan``: which strategy fits, on how many nodes, how long it takes, what to ask for.

The model is measured without real memory (``fake_model``, ``model_facts``); everything
after that is arithmetic over those facts (``options``, ``state_bytes``, ``step_time``),
assembled into rows and a recommendation (``estimate``) and printed (``render``).
"""
