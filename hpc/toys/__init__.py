"""The built-in toy models ('toy', 'toy-chat'): built once with a fixed, seeded amount of
training and cached. They stand above ``hpc.data`` and ``hpc.models`` (they train on the
tasks and use the generation path), which never import them; the job start resolves
``model.path`` through :func:`hpc.toys.builtin.model_folder`."""
