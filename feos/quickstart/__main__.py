"""`python -m feos.quickstart`: what hack/run runs once everything is installed."""

from feos.quickstart import main

raise SystemExit(main())
