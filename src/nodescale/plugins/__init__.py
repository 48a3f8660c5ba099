"""The user's own model, dataset and loss: ``--model FILE.py:FN``, ``--dataset ...``, ``--loss ...``.

``refs`` reads and checks a reference without importing torch (the launcher's side);
``calls`` imports and calls it, showing only the user's own frames when it fails;
``data`` and ``build`` turn what the functions return into what a run needs.
"""
