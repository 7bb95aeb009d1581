"""The run report: an HTML page with plots and a trajectory browser, from a run directory.

``agentrl report RUN_DIR`` builds it.

Owns reading ``metrics.jsonl``/``trajectories.jsonl`` and building the page
(:mod:`~agentrl.report.build`), the page itself (:mod:`~agentrl.report.page`), the summary's
facts as readable chips (:mod:`~agentrl.report.chips`) and the PNG plots with their captions
(:mod:`~agentrl.report.plots`). See ``docs/architecture.md``.

Reads run directories and ``agentrl.types`` only; must never import ``agentrl.learner``,
``agentrl.rollout``, ``agentrl.inference`` or ``agentrl.loop``: a report never needs a model.
"""
