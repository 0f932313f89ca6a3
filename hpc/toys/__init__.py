"""The built-in toy models ('toy', 'toy-chat'): built once with a fixed, seeded amount of
training and cached. They stand above ``hpc.data`` and ``hpc.models`` (they train on the
tasks and use the generation path), which never import them; ``model.path`` finds them
through the import strings of ``hpc.models.folders.BUILT_IN_MODELS``
(:func:`hpc.models.loading.model_folder`)."""

# The toy's build (its cache folder's name, toy_info.json's ``version``), here rather than in
# hpc.toys.toy so that readers of results files (tools.docs.pages) name it without torch.
TOY_VERSION = "toy-model-v3"
TOY_CHAT_VERSION = "toy-chat-v2"  # the chat toy's (hpc.toys.toy_chat)
