"""One module per model family: its paper-size configuration, its pretrained loader and its :class:`Backbone`."""
