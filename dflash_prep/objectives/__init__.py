"""What each training objective needs from the data side: anchors, drafter cost model, its packing."""
