from llmserve.cli import main

main()
