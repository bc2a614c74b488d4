"""What the tests share, in one package: test modules and ``conftest.py`` import helpers from
here (and the kit, ``stack``), never from ``conftest.py`` or from one another, so a test
module can be read, moved or deleted alone (``tests/test_layout.py`` checks it).
``conftest.py`` holds fixtures only."""
