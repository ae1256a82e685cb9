"""The application: what a user starts. ``cli`` (the ``gallery`` command), ``workflow`` (the notebooks' calls:
prepare, run the recipes, compare) and ``bench`` (``gallery bench``). It sits on top of every other layer and
nothing imports it but itself."""
