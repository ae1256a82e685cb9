"""gallery_lib: the support package of the accelerated-training notebook gallery.

The notebooks stay thin; this package holds the run configuration, the recipes, the models,
the data pipeline, the training loop, the launcher and the reports (see ``DESIGN.md``).
"""

__version__ = "0.1.0"
