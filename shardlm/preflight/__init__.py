"""Before a run: dry run, memory estimate, the fastest setting (tune), environment report."""
