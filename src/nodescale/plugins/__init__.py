"""Finding and calling the user's own functions: ``--model FILE.py:FN``, ``--dataset ...``, ``--loss ...``.

``refs`` reads and checks a reference without importing torch (the launcher's side);
``calls`` imports and calls it, showing only the user's own frames when it fails.
The lowest layer of the three: what the functions return is turned into what a run
needs by the component that owns it (``models.user_model``, ``data.user_dataset``,
``train.loss``), and nothing here imports those.
"""
