"""The codec names users write (``--codec thc``), importable without torch: command lines list
them as choices before anything heavy loads. ``registry`` builds each one and checks this list."""

CODEC_NAMES = ("none", "fp16", "bfp", "thc", "thc-uniform", "thc-uniform-unrotated", "topk",
               "dgc", "terngrad", "qsgd", "powersgd")
