#include "client/cli/app.h"

int main(int argc, char** argv) { return gradwatch::cli::Main(argc, argv); }
