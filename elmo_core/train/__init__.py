"""Training the biLM: the objective, checkpoints, the loop, evaluation, export, and the launch on several ranks.

checkpoint    training checkpoints (one record per rank; the best weights) with their SHA-256, verified
objective     the biLM and its sampled-softmax loss as one module (what DDP wraps)
evaluate      full-softmax perplexity (a run's heldout checks, the exported model's splits, elmo perplexity)
export        a run's checkpoint or best weights → a bilm-tf/AllenNLP model directory
ddp           the process group, gathering per rank, the replicas' agreement
run           what a run holds and returns, and what of it a checkpoint keeps (save, restore)
loop          setup, train_step, finish, train: the loop itself
launch        training on several processes: torch.distributed.run started and owned by the train stage
mlflow_model  an exported model as an MLflow pyfunc model
"""
