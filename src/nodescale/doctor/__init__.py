"""``nodescale doctor``: a preflight check for what makes multi-node jobs hang.

Every rank gathers facts about itself (:mod:`.facts`, :mod:`.host`) before any process group
exists, hands them to rank 0 through the rendezvous store (:mod:`.exchange`), and rank 0 runs
pure check functions over them (:mod:`.launch_math`, :mod:`.consistency`, :mod:`.network`,
:mod:`.names`, gathered by :mod:`.evaluate`). Only when nothing found would stop a process
group does every rank start one and time a verified all_reduce (:mod:`.collective`,
:mod:`.bandwidth`). :mod:`.runner` puts the steps in order; :mod:`.report` prints the tables
and the JSON document.

Nothing here is imported by ``import nodescale``; torch is imported only by the modules that
need it.
"""
