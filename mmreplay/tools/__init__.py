"""The tools people use on a store: the ``mmreplay`` command, inspection, verification.

    cli            the command line (a thin layer over public functions)
    cli_datasets   the dataset import / export verbs
    inspection     read-only summaries of a store: counts, episodes, files, images
    verify         a full consistency check of a store on disk
"""
