

def test_the_loss_leads_the_training_charts():
    # Keras's logs come in alphabetical order: "accuracy" before "loss".
    layout = build_layout(("batch_", "epoch_"), False, ("accuracy", "loss"))
    [training] = [c for c in layout.category if c.title == "training"]
    assert chart_titles(training) == [
        "loss (batch)", "accuracy (batch)", "loss (epoch)", "accuracy (epoch)"]
    assert list(training.chart[3].multiline.tag) == ["^metrics/epoch_(val_)?accuracy$"]
