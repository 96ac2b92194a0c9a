"""Starting a run's processes and watching them (``launch``: local processes or torchrun's;
a failure, death, hang or signal stops every rank), turning what the ranks reported into one
line (``diagnosis``), starting a failed job again from its newest checkpoint (``restarts``:
``--max-restarts``, crash loops), and fault injection to rehearse it (``faults``). A rank's
traceback goes to the out-dir's logs, never to the terminal."""
