"""``nodescale report``: a markdown report (with PNG plots) of training runs and benchmark outputs.

:func:`nodescale.report.build.build_report` is the entry point; each module
does one job: ``sources`` finds out what a directory is and reads it,
``markdown`` formats numbers and tables, and one ``*_section`` module writes
each part of the report. The figures come from :mod:`nodescale.figures`, which
``nodescale bench`` draws its own plots with too.
"""
