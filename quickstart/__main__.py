"""``python -m quickstart``: the built-in default job (``make run``)."""

from quickstart.run import main

raise SystemExit(main())
